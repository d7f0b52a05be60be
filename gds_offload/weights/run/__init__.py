"""A streamed model (:func:`~gds_offload.weights.run.model.load_streamed`, the
:class:`~gds_offload.weights.run.model.StreamedModel` facade) and what runs on it: layer-major
generation and gradient accumulation, KV caches, measuring it for the planner, ``plan``, and
``from_pretrained``."""
