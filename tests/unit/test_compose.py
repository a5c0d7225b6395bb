"""docker-compose.yml and the Dockerfiles, checked without a Docker engine: the cross-references that compose itself
finds only at `docker compose up`, or never (a wrong peer id, an expert gap). The compose-spec schema and `sh -n`
run as processes, in tests/integration/test_compose_tools.py.

Each cross-reference check is a function from the parsed compose file to a list of problems; every one of them
is also run on a deliberately broken copy, so none of them can pass by checking nothing.
"""

from __future__ import annotations

import copy
import ipaddress
import posixpath
import re
from pathlib import Path
from urllib.parse import urlsplit

import click
import dockerfile
import pytest
from cryptography.hazmat.primitives import serialization
from ruamel.yaml import YAML

from experts.gguf_model import GGUFModel
from experts.slices import parse_range
from node.cli.root import main as cli
from p2p.identity import Identity
from tests.support.cli import parse_cli

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
READY_HINT = "ready.json"


def load_yaml(path: Path) -> dict:
    return YAML(typ="safe", pure=True).load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(COMPOSE)


# ---- reading services -------------------------------------------------------------------------------------------


def services(c: dict) -> dict[str, dict]:
    return c.get("services") or {}


def command(svc: dict) -> list[str]:
    cmd = svc.get("command") or []
    return cmd.split() if isinstance(cmd, str) else [str(a) for a in cmd]


def options(svc: dict, name: str) -> list[str]:
    """Every value of --name in the service's command (``--name=v`` or ``--name v``)."""
    cmd, found = command(svc), []
    for i, arg in enumerate(cmd):
        if arg.startswith(name + "="):
            found.append(arg[len(name) + 1 :])
        elif arg == name and i + 1 < len(cmd):
            found.append(cmd[i + 1])
    return found


def option(svc: dict, name: str) -> str | None:
    values = options(svc, name)
    return values[-1] if values else None


def set_option(svc: dict, name: str, value: str) -> None:
    svc["command"] = [f"{name}={value}" if a.startswith(name + "=") else a for a in command(svc)]


def environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: str(v) for k, v in env.items()}


def service_networks(svc: dict) -> dict[str, dict]:
    nets = svc.get("networks", ["default"])
    return {n: {} for n in nets} if isinstance(nets, list) else {n: v or {} for n, v in nets.items()}


def addresses(svc: dict) -> set[str]:
    return {v["ipv4_address"] for v in service_networks(svc).values() if "ipv4_address" in v}


def owner(c: dict, ip: str) -> str | None:
    return next((name for name, svc in services(c).items() if ip in addresses(svc)), None)


def gateway(c: dict, name: str) -> str | None:
    """The service whose address on one of *name*'s networks is *name*'s MOESWARM_GATEWAY (its NAT router)."""
    ip, mine = environment(services(c)[name]).get("MOESWARM_GATEWAY"), service_networks(services(c)[name])
    return next((other for other, svc in services(c).items() for net, cfg in service_networks(svc).items() if net in mine and cfg.get("ipv4_address") == ip and other != name), None)


def can_reach(c: dict, src: str, dst: str) -> bool:
    """On a shared network, or through the NAT router that src routes through."""
    s, router = services(c), gateway(c, src)
    if set(service_networks(s[src])) & set(service_networks(s[dst])):
        return True
    return router is not None and bool(set(service_networks(s[router])) & set(service_networks(s[dst])))


def build_of(svc: dict) -> tuple[Path, Path] | None:
    """(context, Dockerfile) of a service that is built here."""
    build = svc.get("build")
    if build is None:
        return None
    if isinstance(build, str):
        build = {"context": build}
    context = ROOT / build.get("context", ".")
    return context, context / build.get("dockerfile", "Dockerfile")


def hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


# ---- Dockerfiles and .dockerignore ------------------------------------------------------------------------------


def _ignore_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out, i = out + {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i])), i + 1
    return re.compile(out)


def dockerignored(context: Path, rel: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories decides; ``!`` re-includes."""
    f = context / ".dockerignore"
    lines = [ln.strip() for ln in f.read_text().splitlines()] if f.exists() else []
    parts = posixpath.normpath(rel).split("/")
    prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    ignored = False
    for line in lines:
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rx = _ignore_regex(posixpath.normpath(line.lstrip("!").strip()).lstrip("/"))
        if any(rx.fullmatch(p) for p in prefixes):
            ignored = not negate
    return ignored


def copies(text: str) -> list[list[tuple[list[str], str, str]]]:
    """Per build stage: (sources, destination, workdir) of each COPY/ADD from the build context."""
    stages: list[list[tuple[list[str], str, str]]] = []
    workdir = "/"
    for ins in dockerfile.parse_string(text):
        if ins.cmd == "FROM":
            stages.append([])
            workdir = "/"
        elif ins.cmd == "WORKDIR":
            workdir = posixpath.join(workdir, ins.value[0])
        elif ins.cmd in ("COPY", "ADD") and not any(f.startswith("--from") for f in ins.flags):
            stages[-1].append((list(ins.value[:-1]), ins.value[-1], workdir))
    return stages


def dockerfile_problems(text: str, context: Path) -> list[str]:
    """COPY/ADD sources that are missing from the build context or excluded from it by .dockerignore."""
    problems = []
    for stage in copies(text):
        for sources, _, _ in stage:
            for src in sources:
                if src.startswith(("http://", "https://")) or src.strip("/") in ("", "."):
                    continue  # a URL, or the whole context
                if not list(context.glob(src.strip("/"))):
                    problems.append(f"COPY {src}: no such path in the build context {context}")
                elif dockerignored(context, src):
                    problems.append(f"COPY {src}: excluded from the build context by .dockerignore")
    return problems


def image_source(text: str, context: Path, image_path: str) -> Path | None:
    """The build-context file that the final stage copies to *image_path*, if any (and not dockerignored)."""
    for sources, dest, workdir in reversed(copies(text)[-1]):
        dest = posixpath.join(workdir, dest)
        for src in sources:
            local = context / src.strip("/")
            into_dir = dest.endswith("/") or len(sources) > 1
            target = posixpath.join(dest, local.name) if into_dir and local.is_file() else dest.rstrip("/")
            if local.is_file() and image_path == target:
                found = local
            elif local.is_dir() and image_path.startswith(target + "/"):
                found = local / image_path[len(target) + 1 :]
            else:
                continue
            if found.exists() and not dockerignored(context, str(found.relative_to(context))):
                return found
    return None


def has_healthcheck(svc: dict) -> bool:
    hc = svc.get("healthcheck")
    if hc is not None:
        return not hc.get("disable") and hc.get("test") not in (["NONE"], "NONE")
    built = build_of(svc)
    if built is None or not built[1].exists():
        return False
    last = [ins for ins in dockerfile.parse_string(built[1].read_text()) if ins.cmd in ("FROM", "HEALTHCHECK")]
    return bool(last) and last[-1].cmd == "HEALTHCHECK" and last[-1].value[0] != "NONE"


# ---- cross-reference checks: compose -> problems ---------------------------------------------------------------


def depends_on_problems(c: dict) -> list[str]:
    problems = []
    for name, svc in services(c).items():
        deps = svc.get("depends_on") or {}
        for dep, spec in ({d: {} for d in deps} if isinstance(deps, list) else deps).items():
            if dep not in services(c):
                problems.append(f"{name} depends on {dep!r}, which is not a service")
            elif (spec or {}).get("condition") == "service_healthy" and not has_healthcheck(services(c)[dep]):
                problems.append(f"{name} waits for {dep} to be healthy, but {dep} has no healthcheck")
    return problems


def network_problems(c: dict) -> list[str]:
    declared, problems, taken = c.get("networks") or {}, [], {}
    for name, svc in services(c).items():
        for net, cfg in service_networks(svc).items():
            if net != "default" and net not in declared:
                problems.append(f"{name} uses network {net!r}, which is not declared")
                continue
            ip = cfg.get("ipv4_address")
            if ip is None:
                continue
            pools = ((declared.get(net) or {}).get("ipam") or {}).get("config") or []
            addr = ipaddress.ip_address(ip)
            if not any(addr in ipaddress.ip_network(p["subnet"]) for p in pools if "subnet" in p):
                problems.append(f"{name}: {ip} is outside network {net}'s subnets")
            if any(addr in ipaddress.ip_network(p["ip_range"]) for p in pools if "ip_range" in p):
                problems.append(f"{name}: {ip} is inside {net}'s ip_range, which Docker hands out to other containers")
            if (net, ip) in taken:
                problems.append(f"{name} and {taken[net, ip]} both claim {ip} on {net}")
            taken[net, ip] = name
    return problems


def build_problems(c: dict) -> list[str]:
    problems = []
    for name, svc in services(c).items():
        built = build_of(svc)
        if built is None:
            continue
        context, df = built
        if not context.is_dir():
            problems.append(f"{name}: build context {context} is not a directory")
        elif not df.is_file():
            problems.append(f"{name}: {df} does not exist")
    return problems


def volume_problems(c: dict) -> list[str]:
    problems, volumes, secrets = [], c.get("volumes") or {}, c.get("secrets") or {}
    for name, svc in services(c).items():
        for vol in svc.get("volumes") or []:
            source = vol.get("source") if isinstance(vol, dict) else (vol.split(":")[0] if ":" in vol else None)
            if source is None or (isinstance(vol, dict) and vol.get("type") not in (None, "volume", "bind")):
                continue  # an anonymous volume, tmpfs or the like: nothing to look up
            if source.startswith((".", "/", "~")):
                if not (ROOT / source).exists():
                    problems.append(f"{name} bind-mounts {source}, which does not exist")
            elif source not in volumes:
                problems.append(f"{name} mounts volume {source!r}, which is not declared")
        for secret in svc.get("secrets") or []:
            secret = secret["source"] if isinstance(secret, dict) else secret
            if secret not in secrets:
                problems.append(f"{name} uses secret {secret!r}, which is not declared")
            elif "file" in secrets[secret] and not (ROOT / secrets[secret]["file"]).is_file():
                problems.append(f"secret {secret}: {secrets[secret]['file']} does not exist")
    return problems


def port_problems(c: dict) -> list[str]:
    problems, published = [], []
    for name, svc in services(c).items():
        for port in svc.get("ports") or []:
            if isinstance(port, dict):
                ip, host, proto = port.get("host_ip", ""), str(port.get("published", "")), port.get("protocol", "tcp")
            else:
                spec, _, proto = str(port).partition("/")
                fields = spec.rsplit(":", 2)
                ip, host = (fields[0] if len(fields) == 3 else ""), (fields[-2] if len(fields) > 1 else "")
                proto = proto or "tcp"
            if not host:
                continue  # the engine picks a free host port
            for other, oip, ohost, oproto in published:
                if (ohost, oproto) == (host, proto) and (ip in ("", "0.0.0.0") or oip in ("", "0.0.0.0") or ip == oip):
                    problems.append(f"{name} and {other} both publish host port {host}/{proto}")
            published.append((name, ip, host, proto))
    return problems


def workers(c: dict) -> dict[str, dict]:
    return {n: s for n, s in services(c).items() if "worker" in command(s)}


def expert_problems(c: dict) -> list[str]:
    problems, hosted, public = [], set(), set()
    internal = {n for n, cfg in (c.get("networks") or {}).items() if (cfg or {}).get("internal")}
    n_expert = None
    for name, svc in workers(c).items():
        built, model = build_of(svc), option(svc, "--model")
        source = image_source(built[1].read_text(), built[0], model) if built and model else None
        if source is None:
            problems.append(f"{name}: --model {model} is not a file the image copies from the build context")
            continue
        n_expert = GGUFModel(source).cfg.n_expert
        text = option(svc, "--experts")
        experts = set(parse_range(text, n_expert, "expert") if text else range(n_expert))
        hosted |= experts
        if not set(service_networks(svc)) & internal:
            public |= experts
    if n_expert is not None:
        for who, got in (("the workers", hosted), ("the public workers", public)):
            if missing := sorted(set(range(n_expert)) - got):
                problems.append(f"{who} host no copy of experts {missing} (the model has {n_expert})")
    return problems


def _bootstrap_target(c: dict, name: str, addr: str) -> str | None:
    """Why the --bootstrap multiaddr *addr* of service *name* does not name a node it can join, or None."""
    m = re.fullmatch(r"/ip4/([\d.]+)/tcp/(\d+)/p2p/(\w+)", addr)
    if not m:
        return f"{name}: --bootstrap {addr} is not /ip4/IP/tcp/PORT/p2p/ID"
    ip, port, peer = m.groups()
    target = owner(c, ip)
    if target is None:
        return f"{name}: --bootstrap names {ip}, which no service has"
    if not can_reach(c, name, target):
        return f"{name} cannot reach {target} at {ip}: no shared network or gateway"
    listen = option(services(c)[target], "--listen")
    if listen is None or hostport(listen)[1] != int(port):
        return f"{name}: --bootstrap uses port {port}, but {target} listens on {listen}"
    key = key_file(c, target)
    if key is None:
        return f"{name}: --bootstrap names peer {peer}, but {target} has no fixed key, so its peer id changes"
    actual = str(Identity(serialization.load_pem_private_key(key.read_bytes(), password=None)).peer_id)
    if actual != peer:
        return f"{name}: --bootstrap names peer id {peer}, but {target}'s key {key.name} is {actual}"
    return None


def key_file(c: dict, name: str) -> Path | None:
    """The fixed key a service runs with (docker/entrypoint.sh installs $MOESWARM_KEY_FILE), if any."""
    mounted = environment(services(c)[name]).get("MOESWARM_KEY_FILE", "")
    secret = (c.get("secrets") or {}).get(mounted.removeprefix("/run/secrets/")) or {}
    return ROOT / secret["file"] if mounted.startswith("/run/secrets/") and "file" in secret else None


def address_problems(c: dict) -> list[str]:
    """Listen/advertise addresses are the service's own; bootstrap multiaddrs name a reachable node by its real peer id."""
    problems = []
    for name, svc in services(c).items():
        own = addresses(svc)
        for opt in ("--listen", "--dht-listen", "--advertise"):
            for value in options(svc, opt):
                host = hostport(value)[0]
                if host not in own and not (host == "0.0.0.0" and opt != "--advertise"):
                    problems.append(f"{name}: {opt} {value} is not an address of {name} ({', '.join(sorted(own)) or 'none fixed'})")
        for addr in options(svc, "--bootstrap"):
            if problem := _bootstrap_target(c, name, addr):
                problems.append(problem)
        for url in options(svc, "--relay"):
            u = urlsplit(url)
            relay = next((n for n, other in services(c).items() if u.hostname in addresses(other) and "relay" in map(str, other.get("command") or [])), None)
            if relay is None:
                problems.append(f"{name}: --relay {url} names no relay service's fixed address")
            elif option(services(c)[relay], "--listen") is None or hostport(option(services(c)[relay], "--listen") or "")[1] != u.port:
                problems.append(f"{name}: --relay {url} is not the port {relay} listens on")
        nets = svc.get("networks") or {}
        if "worker" in map(str, svc.get("command") or []) and nets and all((c.get("networks") or {}).get(n, {}).get("internal") for n in nets):
            if not options(svc, "--relay"):
                problems.append(f"{name}: on internal networks only, so its QUIC address cannot be dialled from outside: it needs --relay")
        if "MOESWARM_GATEWAY" in environment(svc):
            router = gateway(c, name)
            if router is None:
                problems.append(f"{name}: gateway {environment(svc)['MOESWARM_GATEWAY']} is no service's address on {name}'s networks")
            elif "net.ipv4.ip_forward" not in (services(c)[router].get("sysctls") or {}):
                problems.append(f"{name}: gateway {router} does not enable net.ipv4.ip_forward")
            if svc.get("user") not in ("root", "0") or "NET_ADMIN" not in (svc.get("cap_add") or []):
                problems.append(f"{name}: setting its default route needs user: root and cap_add: [NET_ADMIN]")
    return problems


def node_setup_problems(c: dict) -> list[str]:
    """Ready-file healthchecks match --ready-file on a tmpfs; fixed keys land where --data-dir looks."""
    problems = []
    for name, svc in services(c).items():
        test = " ".join(map(str, (svc.get("healthcheck") or {}).get("test") or []))
        for path in re.findall(r"(/\S*" + re.escape(READY_HINT) + ")", test):
            if option(svc, "--ready-file") != path:
                problems.append(f"{name}: the healthcheck waits for {path}, but the command writes --ready-file {option(svc, '--ready-file')}")
            elif posixpath.dirname(path) not in [str(t).split(":")[0] for t in svc.get("tmpfs") or []]:
                problems.append(f"{name}: {posixpath.dirname(path)} is no tmpfs, so a restarted node looks ready at once")
        if "MOESWARM_KEY_FILE" in environment(svc):
            secret = environment(svc)["MOESWARM_KEY_FILE"].removeprefix("/run/secrets/")
            key = key_file(c, name)
            if key is None or secret not in [s["source"] if isinstance(s, dict) else s for s in svc.get("secrets") or []]:
                problems.append(f"{name}: MOESWARM_KEY_FILE is not one of its /run/secrets/ files")
            elif option(svc, "--data-dir") != "/data":
                problems.append(f"{name}: its key is installed as /data/key.pem, so it needs --data-dir=/data")
            elif not key.stat().st_mode & 0o004:
                problems.append(f"{name}: {key} is not readable by others, so the container's user cannot read the mounted secret")
    return problems


CHECKS = [depends_on_problems, network_problems, build_problems, volume_problems, port_problems, expert_problems, address_problems, node_setup_problems]


# ---- tests ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__)
def test_cross_references_hold(compose, check):
    """No problem found by each cross-reference check on docker-compose.yml."""
    assert check(compose) == []


def _without_relay_healthcheck(c):
    del c["services"]["relay"]["healthcheck"]


MUTATIONS = [
    ("depends_on-missing", lambda c: c["services"]["worker-a"]["depends_on"].update(bootstrapp={}), depends_on_problems, "'bootstrapp', which is not a service"),
    ("depends_on-unhealthy", _without_relay_healthcheck, depends_on_problems, "relay has no healthcheck"),
    ("network-undeclared", lambda c: c["services"].__setitem__("backbone", {**c["services"]["backbone"], "networks": ["wann"]}), network_problems, "'wann'"),
    ("ip-outside-subnet", lambda c: c["services"]["worker-a"]["networks"]["wan"].update(ipv4_address="10.203.9.21"), network_problems, "outside network wan"),
    ("ip-in-dynamic-range", lambda c: c["services"]["worker-a"]["networks"]["wan"].update(ipv4_address="10.203.0.200"), network_problems, "ip_range"),
    ("ip-twice", lambda c: c["services"]["worker-b"]["networks"]["wan"].update(ipv4_address="10.203.0.21"), network_problems, "both claim 10.203.0.21"),
    ("build-context", lambda c: c["services"]["nat-router"].update(build="./docker/nat-routr"), build_problems, "nat-routr"),
    ("volume-undeclared", lambda c: c["services"]["worker-a"].update(volumes=["worker-x-data:/data"]), volume_problems, "'worker-x-data'"),
    ("bind-missing", lambda c: c["services"]["worker-a"].update(volumes=["./no-such-dir:/data"]), volume_problems, "no-such-dir"),
    ("secret-file-missing", lambda c: c["secrets"]["bootstrap_key"].update(file="./docker/keys/nope.pem"), volume_problems, "nope.pem"),
    ("host-port-twice", lambda c: c["services"]["relay"].update(ports=["127.0.0.1:4001:8080/tcp"]), port_problems, "host port 4001/tcp"),
    ("expert-gap", lambda c: set_option(c["services"]["worker-b"], "--experts", "16-30"), expert_problems, "[31]"),
    ("model-not-in-image", lambda c: set_option(c["services"]["worker-a"], "--model", "/models/other.gguf"), expert_problems, "/models/other.gguf"),
    ("bootstrap-peer-id", lambda c: [set_option(s, "--bootstrap", "/ip4/10.203.0.10/tcp/4001/p2p/12D3KooWPqvqBSfneSNFbcyjavHErHmiLTuM4bgqC6XmhhCVsbyQ") for s in c["services"].values()], address_problems, "but bootstrap's key bootstrap.pem is"),
    ("bootstrap-port", lambda c: set_option(c["services"]["bootstrap"], "--listen", "10.203.0.10:4009"), address_problems, "bootstrap listens on 10.203.0.10:4009"),
    ("advertise-foreign", lambda c: set_option(c["services"]["worker-a"], "--advertise", "10.203.0.22:4433"), address_problems, "is not an address of worker-a"),
    ("gateway-off-lan", lambda c: c["services"]["nat-worker"]["environment"].update(MOESWARM_GATEWAY="10.203.0.2"), address_problems, "gateway 10.203.0.2"),
    ("ready-file-elsewhere", lambda c: set_option(c["services"]["bootstrap"], "--ready-file", "/data/ready.json"), node_setup_problems, "writes --ready-file /data/ready.json"),
    ("ready-file-not-tmpfs", lambda c: c["services"]["bootstrap"].update(tmpfs=[]), node_setup_problems, "/run/moeswarm is no tmpfs"),
    ("key-not-a-secret", lambda c: c["services"]["bootstrap"].update(secrets=[]), node_setup_problems, "not one of its /run/secrets/"),
    ("gateway-not-root", lambda c: c["services"]["nat-worker"].pop("user"), address_problems, "needs user: root"),
    ("nat-worker-unreachable", lambda c: c["services"]["nat-worker"]["environment"].clear(), address_problems, "nat-worker cannot reach bootstrap"),
    ("nat-worker-without-relay", lambda c: c["services"]["nat-worker"]["command"].remove("--relay=ws://10.203.0.11:8080/relay"), address_problems, "it needs --relay"),
    ("relay-port", lambda c: set_option(c["services"]["nat-worker"], "--relay", "ws://10.203.0.11:9090/relay"), address_problems, "is not the port relay listens on"),
    ("relay-address", lambda c: set_option(c["services"]["nat-worker"], "--relay", "ws://10.203.0.21:8080/relay"), address_problems, "names no relay service"),
    ("key-data-dir", lambda c: set_option(c["services"]["bootstrap"], "--data-dir", "/data/bootstrap"), node_setup_problems, "needs --data-dir=/data"),
]


@pytest.mark.parametrize("mutate, check, expected", [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_each_check_catches_a_broken_copy(compose, mutate, check, expected):
    """Each check reports the specific break made in a copy of docker-compose.yml."""
    broken = copy.deepcopy(compose)
    mutate(broken)
    problems = check(broken)
    assert any(expected in p for p in problems), problems


def command_path_problems(args: list[str]) -> list[str]:
    """What is wrong with the subcommand path of ``moeswarm ARGS``, resolved through the lazy group's get_command."""
    cmd: click.Command = cli
    ctx, path = click.Context(cli, info_name="moeswarm"), ["moeswarm"]
    words = iter(a for a in args if not a.startswith("-"))
    while isinstance(cmd, click.Group):
        name = next(words, None)
        if name is None:
            return [f"`{' '.join(path)}` needs a subcommand, one of {cmd.list_commands(ctx)}"]
        sub = cmd.get_command(ctx, name)
        if sub is None:
            return [f"`{' '.join(path)} {name}`: no such command (known: {cmd.list_commands(ctx)})"]
        path.append(name)
        cmd, ctx = sub, click.Context(sub, info_name=name, parent=ctx)
    return []


def cli_problems(args: list[str]) -> list[str]:
    """What `moeswarm` itself refuses in ``moeswarm ARGS``: an unknown subcommand, flag or value."""
    if problems := command_path_problems(args):
        return problems
    try:
        parse_cli(args)
    except click.UsageError as exc:
        return [f"moeswarm {' '.join(args)}: {exc.format_message()}"]
    return []


NODE_SERVICES = [n for n, s in load_yaml(COMPOSE)["services"].items() if build_of(s) and build_of(s)[0] == ROOT]


@pytest.mark.parametrize("name", NODE_SERVICES)
def test_node_commands_parse_with_the_real_cli(compose, name):
    """Each moeswarm service's command is accepted by `moeswarm` itself: subcommand, flags and values."""
    assert cli_problems(command(compose["services"][name])) == [], name


def test_cli_parse_rejects_a_misspelled_flag():
    """The CLI check is live: a misspelled worker flag is a usage error."""
    with pytest.raises(click.UsageError, match="--modle"):
        parse_cli(["worker", "--modle=/models/embedded.gguf"])


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--log-level=info", "wroker", "--model=/models/embedded.gguf"], "`moeswarm wroker`: no such command"),
        (["--log-level=info", "backbone", "genrate"], "`moeswarm backbone genrate`: no such command"),
        (["--log-level=info", "backbone"], "`moeswarm backbone` needs a subcommand"),
    ],
    ids=["top-level", "nested", "missing"],
)
def test_cli_check_fails_on_an_unknown_subcommand(args, expected):
    """A misspelled or missing subcommand in a compose command is a problem, not a skip."""
    problems = cli_problems(args)
    assert any(expected in p for p in problems), problems


DOCKERFILES = sorted({build_of(s) for s in load_yaml(COMPOSE)["services"].values() if build_of(s)})


@pytest.mark.parametrize("context, path", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)) if isinstance(p, Path) else p)
def test_dockerfile_copy_sources_exist_and_are_not_dockerignored(context, path):
    """Every COPY/ADD source of each Dockerfile that compose builds is in its build context and not excluded."""
    assert dockerfile_problems(path.read_text(), context) == []


def test_dockerfile_check_catches_missing_and_dockerignored_sources():
    """A COPY of a path that does not exist, or of one .dockerignore excludes (tests/, the bootstrap key), is reported."""
    text = "FROM python:3.11-slim\nCOPY pyproject.toml /x/\nCOPY no-such-file /x\nCOPY tests /tests\nCOPY docker/keys/bootstrap.pem /k\n"
    problems = dockerfile_problems(text, ROOT)
    assert [p.split(":")[0] for p in problems] == ["COPY no-such-file", "COPY tests", "COPY docker/keys/bootstrap.pem"], problems


def test_dockerignore_keeps_the_context_small_and_the_image_complete():
    """.dockerignore drops .venv, tests, keys and caches but keeps the package sources and the embedded model."""
    for path in (".venv/bin/python", "tests/unit/test_compose.py", "docker/keys/bootstrap.pem", "experts/__pycache__/x.pyc", "experts/data/embedded.gguf.moeswarm-digest.json"):
        assert dockerignored(ROOT, path), path
    for path in ("pyproject.toml", "experts/data/embedded.gguf", "p2p/dht/kademlia.py", "node/cli.py", "docker/entrypoint.sh"):
        assert not dockerignored(ROOT, path), path


def test_node_image_runs_as_an_unprivileged_user():
    """The node image's final stage switches to a named non-root user."""
    last = [(ins.cmd, ins.value[0]) for ins in dockerfile.parse_string((ROOT / "Dockerfile").read_text()) if ins.cmd in ("FROM", "USER")][-1]
    assert last[0] == "USER" and last[1].partition(":")[0] not in ("root", "0"), last
