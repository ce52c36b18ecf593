"""agentrl-hello: a third-party agentrl plugin (one env, one tool)."""
