"""The worker side: serving dispatches for hosted experts (service) and the node around it, from load to drain (node)."""
