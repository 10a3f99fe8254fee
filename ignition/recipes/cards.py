"""Sampling defaults declared per model from its model card (never from generation_config.json).

SmolLM2-135M-Instruct: the card's usage example samples with `temperature=0.2, top_p=0.9,
do_sample=True` (HuggingFaceTB/SmolLM2-135M-Instruct README, "How to use"). Nothing else is
specified, so top-k and min-p are disabled and the penalties are neutral. Ranges are what a
request may choose (OpenAI-compatible bounds for the penalties).
"""

from __future__ import annotations

from ignition.core.manifest import Range, SamplingDefaults, SamplingParameter

SMOLLM2_135M_INSTRUCT = SamplingDefaults(
    temperature=SamplingParameter(0.2, Range(0.01, 2.0)),
    top_k=SamplingParameter(0.0, Range(0.0, 49152.0)),
    top_p=SamplingParameter(0.9, Range(0.01, 1.0)),
    min_p=SamplingParameter(0.0, Range(0.0, 1.0)),
    repetition_penalty=SamplingParameter(1.0, Range(0.5, 2.0)),
    presence_penalty=SamplingParameter(0.0, Range(-2.0, 2.0)),
    frequency_penalty=SamplingParameter(0.0, Range(-2.0, 2.0)),
    max_output_tokens=2048,
)

# Cards without a model card of their own (seeded random-weight checkpoints): the filters are
# disabled, penalties neutral, temperature 1.
NEUTRAL = SamplingDefaults(
    temperature=SamplingParameter(1.0, Range(0.01, 2.0)),
    top_k=SamplingParameter(0.0, Range(0.0, 1e9)),
    top_p=SamplingParameter(1.0, Range(0.01, 1.0)),
    min_p=SamplingParameter(0.0, Range(0.0, 1.0)),
    repetition_penalty=SamplingParameter(1.0, Range(0.5, 2.0)),
    presence_penalty=SamplingParameter(0.0, Range(-2.0, 2.0)),
    frequency_penalty=SamplingParameter(0.0, Range(-2.0, 2.0)),
    max_output_tokens=2048,
)
