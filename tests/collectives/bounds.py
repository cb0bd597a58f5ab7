"""How far a compressed all-reduce may land from the exact average: the relative error
of the averaged result, per compressor, for independent Gaussian inputs (two
compressions for two_phase), and the slack of each input dtype."""

import torch

ERROR_BOUND = {
    "none": 1e-6,
    "fp16": 2e-3,
    "bf16": 2e-2,
    "int8": 0.03,
    "int4": 0.4,
    "int2": 1.6,
    "ternary": 1.6,
    "qsgd": 2.5,
    "mxfp8": 0.1,
    "mxfp4": 0.4,
    "nvfp4": 0.4,
    "sign": 1.2,
    "topk": 1.0,
    "randk": 1.0,
    "powersgd": 1e-6,  # vectors go as they are; tests/compressors/test_low_rank.py covers matrices
}
DTYPE_SLACK = {torch.float32: 0.0, torch.float16: 2e-3, torch.bfloat16: 2e-2}
