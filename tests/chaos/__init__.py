"""The chaos and jitter suite: real daemons, one fault per case, DESIGN.md section 4 checked."""
