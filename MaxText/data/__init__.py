"""Input pipelines. Every batch is a dict of [B, L] int32 arrays: inputs, targets, inputs_position,
inputs_segmentation, targets_segmentation (segment 0 = padding)."""
