"""agentrl: asynchronous agentic RL for language models."""
