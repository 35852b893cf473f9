"""Pickle safety and what pickles describe: the stream guard (:mod:`.guard`), the restricted
unpicklers (:mod:`.unpicklers`), the stand-ins they resolve torch's names to (:mod:`.stand_ins`),
tensor references (:mod:`.refs`), state-dict trees flattened as DCP does (:mod:`.tree`), and a
reference's bytes (:mod:`.tensor_io`).

Nothing here executes code from a checkpoint. It imports :mod:`..io` and below."""
