"""Import an upstream MaxText (0.2.5) checkpoint's parameters as this trainer's:

    python -m MaxText.utils.ckpt_conversion.from_upstream configs/base.yml model_name=<model> \\
        load_parameters_path=<upstream run>/checkpoints/<step>/items base_output_directory=<out> \\
        [scan_layers=true|false] [key=value ...]

The model keys are the ones the upstream run used (its model file, which model_name also takes by path, and the
model keys of its command line): the same keys build the same model in both trainers. Reads upstream's params
(params/params/..., a training checkpoint, or params/..., a params-only one; scanned or not, as its names say)
and, for DeepSeek, its routing biases (nnx_aux/model/.../gate/bias); its optimizer state and RNG state are not
read. Writes

    <out>/0/items       the params (and routing biases) in this trainer's tree, laid out by scan_layers here
                        (load_parameters_path=<out>/0/items)
    <out>/0/checksums   each array's shape

Every upstream parameter must have a place in the model and every parameter here a source (else one line naming
it, nothing written); the step directory appears complete or not at all. Streams: one layer of one array at a
time, the experts one by one (upstream_ckpt.copy). The name table is in upstream_ckpt's docstring.
"""

from __future__ import annotations

import sys

from MaxText.config.load import tool_main
from MaxText.utils.ckpt_conversion.upstream_ckpt import from_upstream


def main(argv=None) -> int:
    return tool_main(from_upstream, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
