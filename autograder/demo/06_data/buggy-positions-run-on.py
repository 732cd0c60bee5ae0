# A realistic mistake: sequences are packed and masked apart, but the position ids run on along the
# row instead of restarting at 0 for each sequence. The model's position embeddings then tell the
# third sequence of a row that it starts at position 180: its loss is not the loss it has alone.
# %% grade_id=packing_code
def pack_sequences(seqs, max_len):
    rows, room = [], []
    for i in sorted(range(len(seqs)), key=lambda k: -len(seqs[k])):
        n = len(seqs[i])
        if n > max_len:
            raise ValueError(f"sequence {i} is longer than a row")
        for r in range(len(rows)):
            if room[r] >= n:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(max_len - n)
    tokens = torch.full((len(rows), max_len), PAD, dtype=torch.long)
    seq_ids = torch.full((len(rows), max_len), -1, dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            tokens[r, at:at + len(seqs[i])] = seqs[i]
            seq_ids[r, at:at + len(seqs[i])] = i
            at += len(seqs[i])
    position_ids = torch.arange(max_len).repeat(len(rows), 1) * (seq_ids >= 0)
    return Packed(tokens, position_ids, seq_ids)


def block_diagonal_mask(seq_ids):
    causal = torch.ones(seq_ids.shape[1], seq_ids.shape[1], dtype=torch.bool).tril()
    return (seq_ids[:, :, None] == seq_ids[:, None, :]) & (seq_ids >= 0)[:, None, :] & causal
