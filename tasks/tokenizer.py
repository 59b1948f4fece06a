"""tokenizer.py: the tokenizer of the small models pretrain.py makes: BPE over printable ASCII with
every digit a token of its own, Qwen's special tokens and a Qwen-style chat template.

    python pretrain.py --preset cpu --out DIR       # builds one from the task's corpus, saves it

A character outside the alphabet is an error, never a silent <unk> (encode_checked names it; the
saved tokenizer raises too). The folder pretrain.py writes loads unchanged in transformers.
Leaves out: byte fallback, any alphabet beyond printable ASCII.
"""
from tasks import data

# Qwen's names: train.py stops on the last two
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# The BPE unknown token is deliberately NOT in the vocabulary: encoding a character outside the
# alphabet then raises (tokenizers: "Unk token `...` not found in the vocabulary") instead of
# producing a silent <unk>. Its name says why.
UNK = ("[error: a character outside this tokenizer's alphabet (printable ASCII); remove it from "
       "the prompt]")
ALPHABET = sorted(set(chr(c) for c in range(32, 127)) | {"\n", "\t"})
CHAT_TEMPLATE = ("{%- for m in messages %}"
                 "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{%- endfor %}"
                 "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def chat_text(question: str, answer: str | None = None) -> str:
    """The chat-formatted text of one example: the same system prompt and template as
    data.build_prompt."""
    text = (f"<|im_start|>system\n{data.SYSTEM_PROMPT}<|im_end|>\n"
            f"<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")
    return text if answer is None else text + answer + "<|im_end|>\n"


def build_tokenizer(sample: list[str], vocab_target: int = 256):
    """A BPE tokenizer trained on `sample` (chat-formatted texts of the corpus), as a transformers
    tokenizer with the chat template; vocab_target: the vocabulary size to aim at.

    Pre-tokenization keeps every digit a token of its own (the arithmetic is done digit by digit)
    and lets words merge, so the system prompt costs a dozen tokens, not seventy characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\d| ?[A-Za-z]+|\\boxed\{|\s+|."),
                                             behavior="isolated")
    tok.decoder = decoders.Fuse()  # tokens are raw text pieces: decoding concatenates them
    trainer = trainers.BpeTrainer(vocab_size=vocab_target, special_tokens=list(SPECIALS),
                                  initial_alphabet=ALPHABET, limit_alphabet=len(ALPHABET),
                                  min_frequency=50, show_progress=False)
    tok.train_from_iterator(sample, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", bos_token=None, unk_token=None,
                                 model_max_length=1024)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def encode_checked(tok, texts: list[str]) -> list[list[int]]:
    """Token ids of each text (one batched call), or a clear ValueError naming the characters the
    tokenizer cannot encode."""
    bad = sorted(set("".join(texts)) - set(ALPHABET))          # set difference: C speed
    if bad:
        raise ValueError(f"the text has characters this tokenizer cannot encode: {''.join(bad)!r} "
                         "(its alphabet is printable ASCII plus newline and tab); remove or "
                         "replace them")
    return [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
