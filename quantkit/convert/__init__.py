"""The conversion pipeline: source shards -> plan -> (calibration) -> per-shard workers -> publish.

`pipeline.convert` runs it (lock, resume, preflight, workers, publish); `plan` decides every tensor's fate,
`worker` / `fp4` stream one source shard into part files, `partial` keeps OUT.partial and its journal,
`publish` finalizes and renames atomically, `ranks` splits the work under torchrun, `space` checks free space
first, and `inspect` shows what a conversion would do. Import from the defining module (this file imports
nothing, so `inspect` and `plan` never load torch).
"""
