# The moeswarm node image: one image for every role (bootstrap, relay, worker, backbone); the command picks it.
# docker-compose.yml runs the whole topology. Needs BuildKit (Docker's default builder since 23.0).

# ---- build: wheels for every dependency and for moeswarm itself -------------------------------------------------
FROM python:3.11-slim AS build
# libp2p 0.8.1 depends on fastecdsa, which has no wheel on PyPI: it compiles against GMP. ggml-python (the
# expert kernel) has no wheel either: it compiles libggml (C and C++; scikit-build-core fetches CMake from PyPI).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ libc6-dev libgmp-dev \
    && rm -rf /var/lib/apt/lists/*
# An image runs on machines other than the one that built it: target AVX2/FMA/F16C x86-64 instead of -march=native.
# The CPU features the build uses are part of the kernel identity a worker announces.
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
WORKDIR /src
# Dependencies first, read from pyproject.toml (no second list to keep in step), so editing the code
# does not rebuild them.
COPY pyproject.toml ./
RUN python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' > requirements.txt \
    && pip wheel --wheel-dir /wheels -r requirements.txt
COPY README.md ./
COPY experts ./experts
COPY node ./node
COPY p2p ./p2p
COPY relay ./relay
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---- runtime ----------------------------------------------------------------------------------------------------
FROM python:3.11-slim
# iproute2: a NAT-bound node points its default route at the NAT router (docker/entrypoint.sh).
# libgomp1: libggml's threads are OpenMP's.
RUN apt-get update \
    && apt-get install -y --no-install-recommends iproute2 libgomp1 \
    && rm -rf /var/lib/apt/lists/*
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 MOESWARM_HOME=/data
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels moeswarm
# The embedded model at a short path (it is also package data inside the wheel; 15 MB twice is the price of
# a path that does not depend on site-packages' location). `inspect` proves the install works and writes the
# model's digest cache beside it, which the unprivileged user could not do at run time.
COPY experts/data/embedded.gguf /models/embedded.gguf
RUN moeswarm inspect /models/embedded.gguf

COPY --chmod=755 docker/entrypoint.sh /usr/local/bin/moeswarm-entrypoint
# /data: the node's key (a volume keeps the peer id across re-creation); /run/moeswarm: ready files.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/moeswarm moeswarm \
    && install -d -o moeswarm -g moeswarm /data /run/moeswarm
USER moeswarm
WORKDIR /home/moeswarm
# No HEALTHCHECK here: readiness differs by role (a ready file for DHT nodes, a TCP port for the relay,
# none for a one-shot backbone), so docker-compose.yml declares one per service.
ENTRYPOINT ["/usr/local/bin/moeswarm-entrypoint"]
CMD ["--help"]
