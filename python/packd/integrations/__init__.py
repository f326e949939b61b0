"""packd's adapters to the frameworks it serves, in one room (docs/client.md, docs/trl.md):

- documents: where a packed row's documents are and what each query sees, written once;
- varlen: the packd_varlen attention for transformers' models;
- stateful: every document its own state in the layers that carry state across tokens;
- checks: what a model must be for packd to train it packed, by its structure;
- probe: the leak probe, which checks what it computes;
- hf: Hugging Face's drop-ins and packed_row (public as packd.hf);
- trl, trl_stream: TRL's GRPOTrainer on packd (public as packd.trl);
- compat: every private name of TRL and transformers these touch, checked against the
  tested releases.

Nothing here imports transformers or TRL until it is used: `import packd` stays light."""
