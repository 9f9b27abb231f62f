"""The core every other package stands on: errors, the path-safety rule, durable writes and locks, progress
reporting, the torchrun world and the names of JSON data. Imports nothing else from quantkit."""
