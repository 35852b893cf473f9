"""The operations users call on open checkpoints, each streaming with a progress callback and
a cancel token: :mod:`.convert` (any format to any, with selections, casts and the output bound),
:mod:`.mappings` (a model's names and layouts to another framework's: torchtitan <-> Hugging Face),
:mod:`.compare` (diff), :mod:`.verify` (an output against its source), :mod:`.integrity` (is one
checkpoint whole: ``check``, content digests), :mod:`.explore` (statistics, histograms, 2-D slices,
export of one tensor), :mod:`.report` (models and reports as JSON and text) and the :mod:`.demo`
checkpoints.

They open checkpoints through :mod:`..checkpoints`, never re-deriving a location or a format.
Inside, imports point down: verify, demo and mappings over report and integrity, over compare and
explore, over convert."""
