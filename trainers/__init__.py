"""agentrl.trainers"""
