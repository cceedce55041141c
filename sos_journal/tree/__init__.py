"""``JournaledTree``: the one filesystem core every face writes through. Each change is made in
the cache directory and journaled by the writer; ``barrier_rule`` says which renames and
closes wait for the server (protocol.md §3.4); ``open`` (``open_namespace``) opens a
namespace's cache, writer and tree, rebuilding an empty or crash-dirty cache through the
rebuild function it injects (so the tree itself never imports restore).

May import: ``sos_journal.writer``, ``rebuild`` (``open`` only), ``read``, ``format``,
``beneath``, ``errors``, sos_client.
"""
