"""A padded batch's rows as the attention takes them: transformers' 2-D attention_mask (nonzero on
a token) over a dynamic cache's key slots. Whether no row has padding (FULL), whether every row's
tokens are one run ending at the last slot (LEFT_PADDED: a generation's left-padded batch, whose
key ranges the decode kernels read), and each row's key range [first token, last token + 1).
templates/kernel/padding_runs.cu.j2 answers it on the GPU in one launch (a block a row), its rows'
flags read back once and folded (where a dozen small PyTorch ops and two reads did); `runs` is its
NumPy twin, which the tests hold it to."""

from __future__ import annotations

import numpy as np

FULL = 1  # every slot of every row holds a token
LEFT_PADDED = 2  # every row has a token, and its tokens are one run to the last slot
THREADS = 1024  # the kernel's block: a row (B 1 at 128k keys: 128 slots a thread)
UNROLL = 4  # a thread's loads in flight together

# the mask dtypes the kernel reads (PyTorch's names) -> the C type of an element
MASK_TYPES = {"int64": "long long", "int32": "int", "bool": "unsigned char"}


def runs(mask: np.ndarray) -> tuple[int, np.ndarray]:
    """(flags, ranges) of `mask` [B, n]: flags FULL | LEFT_PADDED as they hold; ranges int32
    [2, B], row 0 each row's first token's slot (n where it has none), row 1 its last token's
    slot + 1 (0 where it has none)."""
    tokens = np.asarray(mask) != 0
    b, n = tokens.shape
    count = tokens.sum(-1)
    some = count > 0
    if n == 0:  # (argmax has no empty axis): every row full, none a run
        return FULL | (LEFT_PADDED if b == 0 else 0), np.zeros((2, b), np.int32)
    first = np.where(some, tokens.argmax(-1), n)
    last = np.where(some, n - tokens[:, ::-1].argmax(-1), 0)
    flags = (FULL if bool((count == n).all()) else 0) | \
        (LEFT_PADDED if bool((some & (last == n) & (last - first == count)).all()) else 0)
    return flags, np.stack([first, last]).astype(np.int32)


def fold(row_flags) -> int:
    """The batch's flags from the kernel's flags a row: FULL and LEFT_PADDED where every row has them."""
    flags = FULL | LEFT_PADDED
    for row in row_flags:
        flags &= row
    return flags
