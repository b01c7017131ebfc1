"""Remote models: MultiLoraTransformersModel trains a LoRA adapter on twinkle-server."""

from twinkle_client.model.multi_lora_transformers import MultiLoraTransformersModel, SavedCheckpoint

__all__ = ["MultiLoraTransformersModel", "SavedCheckpoint"]
