# expect: packing=failed
# Packing without the bin-packing: every sequence is cut to fit whatever room is left in the current
# row, so rows are always full and there is no padding to speak of, but sequences lose their tails.
# %% grade_id=packing_code
def pack_sequences(seqs, max_len):
    rows = -(-sum(len(s) for s in seqs) // max_len)
    tokens = torch.full((rows, max_len), PAD, dtype=torch.long)
    position_ids = torch.zeros((rows, max_len), dtype=torch.long)
    seq_ids = torch.full((rows, max_len), -1, dtype=torch.long)
    r, at = 0, 0
    for i, seq in enumerate(seqs):
        if at == max_len:
            r, at = r + 1, 0
        if r == rows:
            break
        part = seq[: max_len - at]
        tokens[r, at:at + len(part)] = part
        position_ids[r, at:at + len(part)] = torch.arange(len(part))
        seq_ids[r, at:at + len(part)] = i
        at += len(part)
    return Packed(tokens, position_ids, seq_ids)


def block_diagonal_mask(seq_ids):
    causal = torch.ones(seq_ids.shape[1], seq_ids.shape[1], dtype=torch.bool).tril()
    return (seq_ids[:, :, None] == seq_ids[:, None, :]) & (seq_ids >= 0)[:, None, :] & causal
