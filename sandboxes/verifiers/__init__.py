"""Verifiers: rewards that check answers (math) or run code (code) in a sandbox."""
