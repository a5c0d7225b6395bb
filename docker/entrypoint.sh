#!/bin/sh
# Entrypoint of the moeswarm image: optional network and key setup for compose services, then `moeswarm ARGS`.
#   MOESWARM_GATEWAY=IP     NAT-bound node: default route via the NAT router (start as root with NET_ADMIN)
#   MOESWARM_KEY_FILE=PATH  run with this fixed key (a compose secret), installed as /data/key.pem: pass --data-dir /data
set -eu

if [ -n "${MOESWARM_GATEWAY:-}" ]; then
    if ! ip route replace default via "$MOESWARM_GATEWAY"; then
        echo "moeswarm-entrypoint: setting the default route needs 'user: root' and 'cap_add: [NET_ADMIN]'" >&2
        exit 1
    fi
    # The route was the only reason to be root: continue as the image's user, with no capabilities left.
    unset MOESWARM_GATEWAY
    export HOME=/home/moeswarm
    exec setpriv --reuid=moeswarm --regid=moeswarm --init-groups --inh-caps=-all --bounding-set=-all -- "$0" "$@"
fi

if [ -n "${MOESWARM_KEY_FILE:-}" ]; then
    # A secret is bind-mounted with its host file's mode, and moeswarm refuses a key that others can read.
    install -m 600 "$MOESWARM_KEY_FILE" /data/key.pem
fi

exec moeswarm "$@"
