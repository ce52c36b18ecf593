"""agentrl.sandboxes"""
