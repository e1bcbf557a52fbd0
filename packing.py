"""
Packing and batches: how examples become the rows of a forward pass, and which rows a step reads.

Examples are (inputs, targets) pairs built per document before packing, so a label is never rolled across
the boundary of two documents. Packed into one row, each document keeps its own positions (restarting at
0) and attention never crosses it (the model's doc_ids):

    pack_bfd        best-fit decreasing: rows of example indices (SFT, pretraining)
    make_batch      tensors of a list of rows, packed (with doc_ids) or padded
    pack_sequences  whole sequences laid out right-padded, left-padded or packed, all giving the same
                    outputs (reward-model scores, DPO's sequence log-probs)
    micro_batches   sequences grouped into forward passes by tokens, not rows (every rank the same count)
    epoch_batch     the rows of a step: a pure function of (seed, step), so a resumed run reads what an
                    uninterrupted one would
"""
from collections import defaultdict

import numpy as np
import torch

from common import UserError, all_reduce_dict, all_reduce_max, autocast, dist_info, rank_passes

IGNORE = -100  # the target of a position that is not trained


def pack_bfd(lengths, capacity):
    """Best-fit decreasing: longest first, each into the open row with the least room that still fits
    it (a new row when none does). Returns rows as lists of example indices. O(n * capacity)."""
    rows, by_room = [], defaultdict(list)  # room left -> rows with exactly that much room
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"example {i} has {n} tokens, more than the row capacity {capacity}")
        room = next((r for r in range(n, capacity + 1) if by_room[r]), None)
        if room is None:
            rows.append([i])
            r, left = len(rows) - 1, capacity - n
        else:
            r = by_room[room].pop()
            rows[r].append(i)
            left = room - n
        by_room[left].append(r)
    return rows


def pack_sequences(seqs, pad_id, layout="right", capacity=None, targets=None):
    """Lay whole sequences out in rows for one forward: (ids, doc_ids, targets, ends), ends being the
    (rows, columns) of each sequence's last token. targets (per sequence, or None for none) are laid out
    alongside, IGNORE elsewhere. Layouts, all giving each sequence the same outputs:
      right   one sequence per row, padded after it: no mask needed (causal attention never looks right)
      left    one per row, padded before it: the padding is a document of its own, so nothing attends to it
      packed  best-fit packed into rows of `capacity` tokens, each sequence its own document (positions
              restart, attention never crosses): no padding compute, the training default."""
    if layout == "packed":
        rows = pack_bfd([len(s) for s in seqs], capacity or max(len(s) for s in seqs))
    elif layout in ("right", "left"):
        rows = [[i] for i in range(len(seqs))]
    else:
        raise ValueError(f"layout must be 'right', 'left' or 'packed', got {layout!r}")
    T = max(sum(len(seqs[i]) for i in row) for row in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    docs = torch.zeros((len(rows), T), dtype=torch.long)
    tgt = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    where = [None] * len(seqs)  # (row, column) of each sequence's last token
    for r, row in enumerate(rows):
        col = T - len(seqs[row[0]]) if layout == "left" else 0
        docs[r, :col] = -1  # left padding: a document before the sequence
        for d, i in enumerate(row):
            n = len(seqs[i])
            ids[r, col:col + n] = torch.tensor(seqs[i])
            if targets is not None and targets[i] is not None:
                tgt[r, col:col + n] = torch.tensor(targets[i])
            docs[r, col:col + n] = d
            col += n
            where[i] = (r, col - 1)
        docs[r, col:] = len(row)  # right padding: a document after them
    return ids, docs, tgt, tuple(torch.tensor(where).T)


def collate(examples, row, pad_id, length=None):
    """One row of packed examples -> inputs, targets, doc_ids (padding is a document of its own)."""
    inputs, targets, docs = [], [], []
    for d, i in enumerate(row):
        x, y = examples[i]
        inputs += x
        targets += y
        docs += [d] * len(x)
    pad = (length or len(inputs)) - len(inputs)
    return inputs + [pad_id] * pad, targets + [IGNORE] * pad, docs + [len(row)] * pad


def make_batch(examples, rows, pad_id, seq_len, packing, device):
    """Tensors for a list of rows. Packed rows are seq_len long with document ids; padded rows are
    as long as the longest in the batch, right-padded, no document ids needed (causal attention never
    looks right)."""
    length = seq_len if packing == "bfd" else max(sum(len(examples[i][0]) for i in row) for row in rows)
    cols = [collate(examples, row, pad_id, length) for row in rows]
    x, y, d = (torch.tensor([c[k] for c in cols], device=device) for k in range(3))
    return x, y, (d if packing == "bfd" else None)


def micro_batches(lengths, max_tokens: int, packed=False) -> list[list[int]]:
    """Sequences grouped into forward passes of at most max_tokens tokens each, so that long sequences
    cannot blow up a fixed row count. Padded (packed=False): a pass is as long as its longest sequence, so
    it costs count x longest; sequences are sorted by length first (little padding). Packed: a pass costs
    the sum of its lengths; the order is kept. A sequence longer than max_tokens is a pass of its own.
    Every rank must run as many passes as the others (a collective per pass under DDP/FSDP): the count is
    agreed over ranks with an all-reduce, and a rank with fewer pads its list with empty passes ([]).
    Example: lengths [5, 30, 8, 31], max_tokens 64 -> [[0, 2], [1, 3]] (2 x 8 and 2 x 31 tokens);
    packed -> [[0, 1, 2], [3]] (43 and 31 tokens)."""
    order = range(len(lengths)) if packed else sorted(range(len(lengths)), key=lambda i: int(lengths[i]))
    passes, current, cost = [], [], 0
    for i in order:
        n = int(lengths[i])
        new_cost = cost + n if packed else (len(current) + 1) * n
        if current and new_cost > max_tokens:
            passes.append(current)
            current, new_cost = [], n
        current.append(i)
        cost = new_cost
    if current:
        passes.append(current)
    n = int(all_reduce_max(len(passes)))
    return passes + [[] for _ in range(n - len(passes))]


@torch.no_grad()
def heldout_loss(model, examples, rows, pad_id, seq_len, packing, device, batch_size=16):
    """Mean next-token loss over the trained tokens of held-out rows (make_batch's rows of examples).
    Each rank computes its share (rows[rank::world]) in as many passes as the others (an FSDP2 forward is a
    collective), then the sums are added up."""
    mine = rows[dist_info().rank::dist_info().world_size]
    model.eval()
    total, count = 0.0, 0
    for batch in rank_passes(model, [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]):
        x, y, d = make_batch(examples, batch, pad_id, seq_len, packing, device)
        with autocast(device):
            total -= model(x, y, doc_ids=d).sum().item()
        count += (y != IGNORE).sum().item()
    model.train()
    sums = all_reduce_dict({"total": total, "count": count}, keys=["total", "count"])
    return sums["total"] / max(1, sums["count"])


def check_batch_fits(batch_size: int, num_rows: int, what: str):
    """A global batch larger than the data would repeat rows within a step (and call that one epoch)."""
    if batch_size > num_rows:
        raise UserError(f"--batch-size {batch_size} is larger than the data: {num_rows} {what}; every step would "
                        f"train some of them twice. Use --batch-size {num_rows} or less, or more data")


def epoch_batch(num_rows, step, batch_size, seed):
    """Indices of the global batch at `step`: a fresh permutation every epoch, a pure function of
    (seed, step), so that a resumed run reads exactly the rows an uninterrupted one would, epoch
    boundaries included."""
    start = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), num_rows)
        perm = np.random.RandomState(seed + epoch).permutation(num_rows)
        out.extend(perm[offset:offset + batch_size - len(out)].tolist())
    return out


def sft_example(ids, mask):
    """Inputs and targets of one conversation: predict token t+1 from tokens <= t, graded only where
    token t+1 is the assistant's. Built per conversation BEFORE packing, so a label can never be rolled
    across the boundary of two packed conversations (verl#6475)."""
    if len(ids) != len(mask) or len(ids) < 2:
        raise ValueError("ids and mask must have the same length (>= 2)")
    targets = [t if m else IGNORE for t, m in zip(ids[1:], mask[1:])]
    if all(t == IGNORE for t in targets):
        raise ValueError("the loss mask is all zero: this conversation has nothing to train on")
    return ids[:-1], targets
