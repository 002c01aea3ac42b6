"""What every process of Switchyard shares, and which imports nothing of Switchyard above it:
the messages between processes and their framing, tracing and metrics set-up, flags and
units, the device, ports, failures and prefix keys."""

__version__ = "0.1.0"
