"""Facts several layers share about the tokenized store entry: its file names and special tokens.

The tokenize stage writes them (`kiln.tasks.data.tokenize`), training, evaluation and export read
them; keeping them here lets the readers depend on the facts rather than on the data layer.
"""

EOS_TOKEN = "<|endoftext|>"  # the tokenizer's one special token: ends every document, pads nothing
TOKENIZER_FILE = "tokenizer.json"  # the trained BPE tokenizer, in the tokenize stage's folder
SHARDS_FILE = "shards.json"  # the listing of token shards per domain and split, with the vocabulary size
DOC_INDEX_SUFFIX = ".docs.npy"  # beside each token shard (NNNNN.bin): its documents' end offsets and quality scores
METRICS_LOG = "train_metrics.jsonl"  # rank 0 appends a line per log step: launched runs and kiln status read it live
BATCH_PREFIX = "batch/"  # a new data batch's sources in a mixture: batch/<name>/<domain> (the loader, the ECG)
