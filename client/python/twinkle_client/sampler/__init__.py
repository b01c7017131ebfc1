"""Remote sampling: vLLMSampler (Twinkle's name) over twinkle.v1.SamplerService."""

from twinkle_client.sampler.vllm_sampler import SampleResponses, vLLMSampler

__all__ = ["SampleResponses", "vLLMSampler"]
