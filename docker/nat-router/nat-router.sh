#!/bin/sh
# Masquerade LAN_SUBNET behind this container's other address and drop unsolicited traffic from outside,
# like a home router: plain MASQUERADE keeps the source port (endpoint-independent mapping) and conntrack
# gives address-and-port-dependent filtering -- the NAT type our netns testbed punches through.
set -eu
: "${LAN_SUBNET:?set LAN_SUBNET to the LAN's CIDR, e.g. 10.203.1.0/24}"
rm -f /run/nat-router.ready

if [ "$(cat /proc/sys/net/ipv4/ip_forward)" != 1 ]; then
    echo "nat-router: IP forwarding is off; give the container 'sysctls: {net.ipv4.ip_forward: 1}'" >&2
    exit 1
fi

iptables -t nat -A POSTROUTING -s "$LAN_SUBNET" ! -d "$LAN_SUBNET" -j MASQUERADE
iptables -A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
iptables -A FORWARD -s "$LAN_SUBNET" -j ACCEPT
iptables -P FORWARD DROP
# Unsolicited input from the WAN must be dropped too: otherwise an early hole-punch packet creates a conntrack
# entry that makes MASQUERADE remap the port, and every punch fails (measured in the netns testbed).
iptables -A INPUT -i lo -j ACCEPT
iptables -A INPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
iptables -A INPUT -s "$LAN_SUBNET" -j ACCEPT
iptables -P INPUT DROP

touch /run/nat-router.ready
echo "nat-router: masquerading $LAN_SUBNET"
exec sleep infinity
