"""Validation for every language model the plugin serves, on torchtitan 0.2.2.

Two gaps of torchtitan 0.2.2 (stock AdamW hits them too):

- its ``Validator`` passes the model's attention masks whatever the attention kind, and a
  model with SDPA attention (llama4's ``assert attention_masks is None``) refuses them: the
  trainer passes them for FlexAttention and varlen only, and so does the validator here;
- the deepseek_v3 and gpt_oss train specs have no validator builder (``assert
  self.train_spec.build_validator_fn is not None``): they get torchtitan's own
  (:func:`validator_for`).
"""

from __future__ import annotations

import functools

from torchtitan.components import validate

#: the attention kinds that take masks (torchtitan's trainer passes them for these only)
MASKED_ATTENTION = ("flex", "varlen")


def validator_for(build_validator_fn):
    """A train spec's validator builder, or torchtitan's own where it has none."""
    return build_validator_fn or validate.build_validator


def _masks_for_masked_attention(post_dataloading_process):
    @functools.wraps(post_dataloading_process)
    def wrapper(self, input_dict, labels, model_parts):
        inputs, labels, extra_inputs, extra_kwargs = post_dataloading_process(
            self, input_dict, labels, model_parts
        )
        model_args = getattr(model_parts[0], "model_args", None)
        if getattr(model_args, "attn_type", "sdpa") not in MASKED_ATTENTION:
            extra_kwargs.pop("attention_masks", None)
        return inputs, labels, extra_inputs, extra_kwargs

    wrapper._dmuon_masks = True
    return wrapper


def install_validation_fix() -> None:
    """Idempotent: the validator passes attention masks as the trainer does."""
    original = validate.Validator.post_dataloading_process
    if not getattr(original, "_dmuon_masks", False):
        validate.Validator.post_dataloading_process = _masks_for_masked_attention(original)
