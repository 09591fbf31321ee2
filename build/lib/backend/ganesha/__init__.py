"""nfs-ganesha: configuration model, files and process supervision."""
