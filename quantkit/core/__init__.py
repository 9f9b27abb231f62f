"""The core every other package stands on: errors, the path-safety rule, durable writes and locks, progress
reporting, and the torchrun world. Imports nothing else from quantkit."""
