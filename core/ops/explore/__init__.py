"""Looking into one tensor without loading it: :mod:`.stats` (streaming statistics), :mod:`.histogram`
(the one binning the window's panes share), :mod:`.slices` (2-D windows and their summaries) and
:mod:`.extract` (export to .npy or .pt)."""
