"""Discovery: signed host records, the Kademlia DHT over py-libp2p, and which announced hosts a backbone uses."""
