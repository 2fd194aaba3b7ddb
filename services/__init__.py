"""Pure domain logic: no I/O, no clocks, no implicit randomness (filled by later issues)."""
