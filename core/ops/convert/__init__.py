"""Conversion: :func:`.convert.convert` plans the entries (:mod:`.transform`: include/exclude,
casts, renames; :mod:`.names`: the patterns), bounds the output (:mod:`.fanout`) and streams them
through a writer (:mod:`.output`: where an output may go, and the three writers) -- or, for a DCP
laid out for a job's ranks, through :mod:`.reshard` (the target ranks' regions from :mod:`.layouts`)."""
