"""Checkpoints into many ranks: local ranks started and supervised (:mod:`.launch`), a
single-file checkpoint read into a sharded job (:mod:`.distributed`, the byte protocol in
:mod:`.transfer`, shared reads of boxes in :mod:`.regions`), and the test load of any
checkpoint into any world size (:mod:`.load`); one conversion on many ranks (:mod:`.convert`),
into S3 as multipart uploads whose parts the ranks send (:mod:`.upload`, the parts in :mod:`.parts`)."""
