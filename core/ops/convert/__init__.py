"""Conversion: :func:`.convert.convert` plans the entries (:mod:`.transform`: include/exclude,
casts, renames; :mod:`.names`: the patterns), bounds the output (:mod:`.fanout`) and streams them
through a writer (:mod:`.output`: where an output may go, and the three writers)."""
