"""Everything behind the request queue: scheduler, KV blocks, model runner, sampler, outputs."""

from engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.errors import InvalidRequestError, ModelLoadError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.lora import LoRARequest
from engine.outputs import CompletionOutput, EmbeddingOutput, PoolingRequestOutput, RequestOutput
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EmbeddingOutput",
    "InvalidRequestError",
    "LLMEngine",
    "LoRARequest",
    "ModelLoadError",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
]
