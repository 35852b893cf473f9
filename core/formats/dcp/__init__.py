"""DCP directories without torch, and torch's DCP interfaces made safe: the directory's files
and streaming writer (:mod:`.files`; one data file per rank of a job: :mod:`.ranked`), the compact
``.metadata`` index (:mod:`.index`), whether chunks tile a tensor (:mod:`.tiling`), and the storage
readers/writers (:mod:`.storage`, :mod:`.writer`, :mod:`.transforms`) and planners
(:mod:`.planners`) used with ``torch.distributed.checkpoint``."""
