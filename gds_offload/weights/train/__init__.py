"""Full fine-tuning of a streamed model: :class:`~gds_offload.weights.train.trainer.StreamedTrainer`
updates each streamed layer in the store, a step written whole or not at all."""
