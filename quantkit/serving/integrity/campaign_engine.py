"""SGLang's own objects for the integrity campaign (``campaign.py``): the memory side (allocator, ``ReqToTokenPool``,
``UnifiedRadixCache``), the output side (``SchedulerBatchResultProcessor`` + ``SchedulerOutputStreamer``, streaming
into a recording sink in place of the detokenizer process), and the content oracle that stands in for the model.

Oracle: every KV slot written gets a stamp, the hash of the token prefix ending at that position (so legitimately
shared prefix pages hold identical stamps). A "forward" writes the new token's stamp through ``req_to_token`` and
reads the whole row back; a request whose reads differ from its own prefix hashes read another request's KV. Its
"sampled" token is then drawn from the poison range ``[CLEAN_VOCAB, VOCAB)``, clean ones from ``[0, CLEAN_VOCAB)``:
a poison id in what the sink receives is a wrong token streamed to a client.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from quantkit.serving.integrity import sglang as plugin

if TYPE_CHECKING:
    from sglang.srt.managers.io_struct import BatchTokenIDOutput
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.utils import GenerationBatchResult

__all__ = ["CLEAN_VOCAB", "VOCAB", "Engine", "OutputPath", "Sink", "load_plugin"]

VOCAB = 32000
CLEAN_VOCAB = 31000
_MASK = (1 << 61) - 1
Reuse = Literal["immediate", "staged"]


def load_plugin() -> None:
    """Load the plugin through SGLang's ``load_plugins()`` with ``QUANTKIT_KV_INTEGRITY=tags`` (the output-side
    modules imported first, as they are in a scheduler process)."""
    import sglang.srt.managers.scheduler_components.batch_result_processor  # noqa: F401
    import sglang.srt.managers.utils  # noqa: F401
    import sglang.srt.plugins as plugins

    os.environ[plugin.ENV] = plugin.ENABLE_VALUE
    os.environ.setdefault("SGLANG_PLUGINS", "quantkit_kv_integrity")  # SGLang's own whitelist: only this plugin
    plugins.load_plugins()
    if not plugin.state().registered:
        raise RuntimeError("load_plugins() did not register the quantkit KV integrity plugin (entry point missing?)")


class Engine:
    """SGLang's memory-side objects for one campaign episode, and the oracle."""

    def __init__(self, page_size: int, size: int, reuse: Reuse, rows: int, row_tokens: int, guarded: bool) -> None:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        staged = reuse == "staged"
        if page_size == 1:
            self.alloc = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", None, staged)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(size, page_size, torch.bfloat16, "cpu", None, staged)
            self.alloc.use_triton_kernels = False  # SGLang's torch path (what it runs where Triton is unsupported)
        self.pool = ReqToTokenPool(rows, row_tokens, "cpu", False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.pool, token_to_kv_pool_allocator=self.alloc,
                                 page_size=page_size, tree_components=(ComponentType.FULL,))  # fmt: skip
        self.tree = UnifiedRadixCache(params)
        if not guarded:
            self.alloc.__dict__.pop("_quantkit_tracker", None)
        self.model = types.SimpleNamespace(vocab_size=VOCAB, is_encoder_decoder=False, think_end_ids=None,
                                           self_opened_think_start_ids=None)  # what ScheduleBatch / output read
        self.stamps = torch.zeros(size + page_size, dtype=torch.int64)
        self.hashes: dict[str, list[int]] = {}
        self.inflight: dict[str, list[int]] = {}  # tokens sampled by forwards whose results are not processed yet

    def tokens(self, req: Req) -> list[int]:
        return [*req.origin_input_ids, *req.output_ids, *self.inflight.get(req.rid, ())]

    def expected(self, req: Req, n: int) -> torch.Tensor:
        h = self.hashes.setdefault(req.rid, [])
        if len(h) < n:
            tokens = self.tokens(req)
            key = h[-1] if h else 0
            while len(h) < n:
                key = hash((key, tokens[len(h)])) & _MASK
                h.append(key)
        return torch.tensor(h[:n], dtype=torch.int64)

    def write(self, req: Req, start: int, end: int) -> None:
        slots = self.pool.req_to_token[req.kv.req_pool_idx, start:end].long()
        self.stamps[slots] = self.expected(req, end)[start:end]

    def write_decode(self, req: Req, slot: int) -> None:
        """A decode forward stores the new token's KV where ``out_cache_loc`` says (slot 0: SGLang's padding)."""
        n = req.kv.kv_committed_len
        self.stamps[slot] = self.expected(req, n)[n - 1]

    def reads_wrong(self, req: Req, n: int) -> bool:
        slots = self.pool.req_to_token[req.kv.req_pool_idx, :n].long()
        return not torch.equal(self.stamps[slots], self.expected(req, n))

    def forget(self, rid: str) -> None:
        self.hashes.pop(rid, None)
        self.inflight.pop(rid, None)


@dataclass
class Sink:
    """Stands in for the detokenizer process: what SGLang's output streamer sends, per request."""

    tokens: int = 0
    poison: int = 0
    finished: dict[str, dict[str, object]] = field(default_factory=dict)

    def send_output(self, payload: BatchTokenIDOutput, *args: object) -> None:
        reasons = payload.finished_reasons or [None] * len(payload.rids)
        for rid, ids, reason in zip(payload.rids, payload.output_ids or [], reasons, strict=False):
            self.tokens += len(ids)
            self.poison += sum(1 for t in ids if t >= CLEAN_VOCAB)
            if reason is not None:
                self.finished[rid] = reason


class OutputPath:
    """SGLang's decode-result processing and output streaming on one engine's objects."""

    def __init__(self, engine: Engine, overlap: bool) -> None:
        from sglang.srt.beam_search.coordinator import BeamCoordinator
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
        from sglang.srt.managers.scheduler_components.logprob_result_processor import (
            SchedulerLogprobResultProcessor,
        )
        from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
        from sglang.srt.runtime_context import get_server_args
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.sink = Sink()
        none = SpeculativeAlgorithm.NONE
        streamer = SchedulerOutputStreamer(send_to_detokenizer=self.sink, tree_cache=engine.tree,
                                           server_args=get_server_args(), is_generation=True, spec_algorithm=none,
                                           disaggregation_mode=DisaggregationMode.NULL,
                                           enable_hicache_storage=lambda: False)  # fmt: skip
        metrics = types.SimpleNamespace(num_generated_tokens=0, forward_ct_decode=0,
                                        report_decode_stats=lambda *a, **k: None)  # fmt: skip
        beams = BeamCoordinator(model_config=engine.model, spec_algorithm=none, dllm_enabled=False, max_req_len=1 << 20,
                                req_to_token_pool=engine.pool, token_to_kv_pool_allocator=engine.alloc,
                                tree_cache=engine.tree, future_map=None)  # fmt: skip
        self.processor = SchedulerBatchResultProcessor(
            is_generation=True, disaggregation_mode=DisaggregationMode.NULL, enable_overlap=overlap,
            enable_overlap_mlx=False, model_config=engine.model, token_to_kv_pool_allocator=engine.alloc,
            tree_cache=engine.tree, hisparse_coordinator=None, req_to_token_pool=engine.pool,
            decode_offload_manager=None, metrics_collector=None, metrics_reporter=metrics, draft_worker=None,
            model_worker=types.SimpleNamespace(), output_streamer=streamer, beam_coordinator=beams,
            logprob_result_processor=SchedulerLogprobResultProcessor(model_config=engine.model),
            abort_request=lambda *a: None,
        )  # fmt: skip

    @staticmethod
    def result(batch: ScheduleBatch, ids: list[int]) -> GenerationBatchResult:
        """The forward's result as SGLang's worker returns it, with the plugin's forward hook applied (the model
        forward itself is the oracle)."""
        from sglang.srt.managers.utils import GenerationBatchResult

        from quantkit.serving.integrity.sglang_check import _after_forward

        result = GenerationBatchResult(next_token_ids=torch.tensor(ids, dtype=torch.int64))
        _after_forward(result, None, batch)
        return result

    @staticmethod
    def copy_to_cpu(batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        """What the overlap scheduler does right after launching a forward (``Scheduler._copy_result_to_cpu``)."""
        result.copy_done = torch.cuda.Event()
        result.copy_to_cpu(return_logprob=batch.return_logprob, return_hidden_states=batch.return_hidden_states)

    def process(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        self.processor.process_batch_result_decode(batch, result)
