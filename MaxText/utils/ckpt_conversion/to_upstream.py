"""Export this trainer's parameters as an upstream MaxText (0.2.5) checkpoint:

    python -m MaxText.utils.ckpt_conversion.to_upstream configs/base.yml model_name=<model> \\
        load_parameters_path=<run>/checkpoints/<step>/items base_output_directory=<out> [key=value ...]

Writes <out>/0/items in upstream's tree (params/params/..., scanned as scan_layers says, the layer axis at
upstream's param_scan_axis; DeepSeek's routing biases under nnx_aux/model/.../gate/bias, where upstream's
training checkpoints keep them), for upstream's load_parameters_path=<out>/0/items with the same model keys. The
step directory appears complete or not at all. Streams: one layer
of one array at a time, the experts one by one (upstream_ckpt.copy). The name table is in upstream_ckpt's docstring.
"""

from __future__ import annotations

import sys

from MaxText.config.load import tool_main
from MaxText.utils.ckpt_conversion.upstream_ckpt import to_upstream


def main(argv=None) -> int:
    return tool_main(to_upstream, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
