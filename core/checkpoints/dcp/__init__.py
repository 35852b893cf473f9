"""A DCP directory as a :class:`~..base.Checkpoint` (:mod:`.checkpoint`): its ``.metadata`` read
into entries and an index (:mod:`.metadata`), in bulk without an object per chunk (:mod:`.fast`,
:mod:`.fast_cut`) or in a child process when large (:mod:`.children`, :mod:`.index_child`), and
chunks read through torch's own read plan when their bytes are transformed (:mod:`.planned`)."""
