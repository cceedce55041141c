package sos.hadoop;

import java.io.IOException;
import java.net.URI;
import java.net.URISyntaxException;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.DelegateToFileSystem;

/**
 * FileContext's {@code webhdfs://} ({@code fs.AbstractFileSystem.webhdfs.impl}) over
 * {@link RideThroughWebHdfsFileSystem}: Spark's checkpoint file manager writes through
 * FileContext, and Hadoop's own WebHdfs AbstractFileSystem builds a plain WebHdfsFileSystem.
 */
public class RideThroughWebHdfs extends DelegateToFileSystem {
  public RideThroughWebHdfs(URI uri, Configuration conf) throws IOException, URISyntaxException {
    super(uri, new RideThroughWebHdfsFileSystem(), conf, "webhdfs", false);
  }

  /** {@code swebhdfs://}: the same over https. */
  public static class Secure extends DelegateToFileSystem {
    public Secure(URI uri, Configuration conf) throws IOException, URISyntaxException {
      super(uri, new RideThroughSWebHdfsFileSystem(), conf, "swebhdfs", false);
    }
  }
}
