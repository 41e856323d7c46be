"""Speculative decoding without a draft model: suffix-tree drafts (``suffix_drafts``), verified exactly by the engine,
and the measured cost model that turns drafts off where they do not pay (``cost_model``)."""
