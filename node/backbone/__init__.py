"""The backbone side: dispatching MoE layers to workers (dispatch), replica choice (routing), hot experts, spot checks, continuous batching, the prefix cache and the session that wires them up."""
