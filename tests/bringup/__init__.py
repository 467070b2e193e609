"""init's rehearsal: plans, fault points, the cleanup contract, the matrix, a vLLM engine."""
