"""Code both services use: TLS and bearer-token plumbing, flags with environment fallbacks,
adapter names, and PEFT adapter validation. Neither service imports the other for these."""
