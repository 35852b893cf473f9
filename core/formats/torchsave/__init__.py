"""torch.save files without torch: the archive's pickle and records, read (:mod:`.archive`) and
written (:mod:`.writer`), the ZIP
layer that reads (:mod:`.zip`, :mod:`.inflated`) and writes (:mod:`.zip_writer`) it, and the
pre-1.6 legacy format (:mod:`.legacy`)."""
