"""Python modules generated from protos/lora/v1 at install time (never edited by hand)."""
