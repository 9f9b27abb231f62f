"""Evaluating served deployments side by side: `quantkit eval --endpoint URL --baseline URL`.

client (OpenAI-compatible HTTP) -> tasks (kl, toolcall, lm-eval accuracy tasks) -> stats (paired
bootstrap, verdict) -> run (resume store, progress, report, quantkit.json["eval"]). See docs/eval.md.
"""
