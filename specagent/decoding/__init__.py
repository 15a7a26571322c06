"""The decoding core: pure, synchronous torch. No asyncio, no I/O, no globals."""
