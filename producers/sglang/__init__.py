"""The SGLang producer: scheduler hooks in SGLang's scheduler process (docs/sglang.md)."""
