"""Builds the tiny offline tokenizer aiperf needs, in a Hugging Face cache layout.

Run with the aiperf venv's python: `make_tokenizer.py HF_HOME`. aiperf synthesises each hash id's
text by sampling token ids from its bundled corpus and decoding them, so the tokenizer must cut
that corpus into many distinct tokens (a byte-level BPE trained on the corpus itself); the
engines count tokens themselves (`--use-server-token-count`), so its vocabulary size only sets
about how many bytes one hash-id block of text is. A 4,096-token BPE on English gives about
4 bytes a token, the `kvmesh replica` tokenizer's ratio, so a 512-token block is about 512
engine tokens.
"""

import glob
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Any 40-hex commit name: the fake cached repo's snapshot.
COMMIT = "0" * 39 + "1"


def corpus_files():
    """aiperf's bundled text corpus (Shakespeare), the text its prompts are sampled from."""
    import aiperf  # noqa: PLC0415  (only in the aiperf venv)

    root = os.path.dirname(aiperf.__file__)
    found = [p for p in glob.glob(os.path.join(root, "**", "*.txt"), recursive=True)
             if os.path.getsize(p) > 100_000]
    if not found:
        sys.exit(f"no text corpus found under {root}")
    return found


def main():
    hf_home = sys.argv[1]
    repo = os.path.join(hf_home, "hub", "models--local--tiny")
    snap = os.path.join(repo, "snapshots", COMMIT)
    if os.path.exists(os.path.join(snap, "tokenizer.json")):
        return
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(corpus_files(), trainer)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    tok.save(os.path.join(snap, "tokenizer.json"))
    with open(os.path.join(snap, "tokenizer_config.json"), "w") as f:
        f.write('{"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", '
                '"eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 1000000000}\n')
    with open(os.path.join(snap, "config.json"), "w") as f:
        f.write('{"model_type": "llama"}\n')
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(COMMIT)


if __name__ == "__main__":
    main()
