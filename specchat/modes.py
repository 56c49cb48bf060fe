"""The modes the app knows, by name, without importing torch: the command line builds its choices from these
before any model loads (`specchat --help` stays fast). Each mode's drafter class is in
specchat.engine.drafters (DRAFTERS, in the same order; a test checks the two agree)."""

# mode name -> one-line description; the order is the order of the chat's keys (F2..F11)
MODES: dict[str, str] = {
    "off": "plain decoding of the target (the baseline)",
    "draft": "a separate draft model sharing the tokenizer",
    "layerskip": "the target with chosen layers skipped",
    "earlyexit": "the target's first layers, then its final norm and LM head",
    "lowrank": "the target with truncated-SVD low-rank linear layers",
    "quant": "an int8 weight copy of the target",
    "lookup": "prompt lookup: n-gram matches in the conversation, no model",
    "head": "a small draft head trained on the target's own features (specchat train-head)",
    "auto": "each round, the fastest of off, suffix, head, quant and draft as measured here (earlier sessions too)",
    "suffix": "suffix matches in this and the saved conversations, most frequent continuation, no model",
}

# the self-speculative modes whose setting `specchat tune` searches, and the drafter option each one takes
TUNABLE: dict[str, str] = {"layerskip": "skip_layers", "earlyexit": "exit_layer", "lowrank": "rank"}
